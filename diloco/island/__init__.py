"""Island side: client, export/apply transfers and the step boundary."""
