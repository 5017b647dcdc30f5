"""Test support: harnesses, fixtures' helpers and generators used by the tests and benchmarks.

Lives under ``tests/`` so that nothing here ships in the wheel. Import as ``tests.support.<module>``
(pyproject puts the repository root on pytest's path; benchmarks insert it themselves).
"""
