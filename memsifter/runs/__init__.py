"""Runs that outlive the call that starts them: :mod:`memsifter.runs.detached`."""
