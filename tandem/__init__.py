"""tandem: disaggregated LLM serving (prefill and decode on separate workers) with EAGLE
speculative decoding on the decode side. See docs/architecture.md for the architecture."""

__version__ = "0.1.0"
