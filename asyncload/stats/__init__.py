"""What the loader measured: per-stage figures, the verdict on the bottleneck, the GIL probe."""
