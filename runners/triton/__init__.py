"""kvforge's engine as a Triton Inference Server model (Python backend); see docs/scaling.md."""
