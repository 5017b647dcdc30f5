"""Layout adapters: how a training stack's local parameters map onto canonical global tensors."""
