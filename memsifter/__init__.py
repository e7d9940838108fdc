"""memsifter: MemSifter memory retrieval (arXiv 2603.03379) as a batch platform."""

__version__ = "0.1.0"
