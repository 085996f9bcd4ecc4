"""The MoonEP ops under torch.compile, Inductor and CUDA graphs (see docs/compile.md)."""
