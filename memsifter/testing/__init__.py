"""Test support shipped with the package: local servers (vLLM, SeaweedFS), fault injection."""
