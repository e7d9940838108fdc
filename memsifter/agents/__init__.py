"""Memory agents (issue 33): a search agent over a user's memory and a reading agent that keeps notes.

One module per agent (prompt, parser, loop), shared by inference and training: see :mod:`.base`.
"""
