"""The plugin's side of vLLM: the only package that touches vLLM internals."""
