"""Credentials never leave: redaction of URLs and keys, the secret scan of published outputs."""
