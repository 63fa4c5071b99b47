"""User-facing entry points that vllm-dsbd routes through a DSBD engine."""
