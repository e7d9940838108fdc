"""The retrieval library every front door uses (the stages, the memory service, the agents, prepare-*, the
reward, the demo): stage modules call it, never each other (tests/test_stage_leaves.py).

- :mod:`.first_stage`: the first stage's scoring (BM25 views, the dense leg, cascade / zsum fusion).
- :mod:`.ranker`: the ranker's options, prompt, engine arguments and answer parsing.
- :mod:`.window`: the one prompt builder (the session window) and its settings; :mod:`.context`: token
  counters (and the one tokenizer-free estimate) and budgeted selection; :mod:`.prompting`: prompt files;
  :mod:`.render`: sessions as text.
- :mod:`.rankings`: rankings files and their parsing; :mod:`.metrics`, :mod:`.benchmark_metrics`: metrics;
  :mod:`.scoring`: rankings and answers scored (evaluate's numbers), :mod:`.report` and :mod:`.plots`: their
  Markdown and figures.
"""
