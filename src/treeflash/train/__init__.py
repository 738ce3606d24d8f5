"""Training: self-distillation data, losses, trainers (torchrun)."""
