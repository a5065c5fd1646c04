"""lowtide: run research jobs on the GPUs an inference fleet is not using, and give every GPU
back the moment inference traffic needs it. See docs/architecture.md and README.md."""

__version__ = "0.1.0"
