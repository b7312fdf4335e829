"""``lukv check``: before deploying a ratio, measure it on your own texts and questions.

For every context (the calibration JSONL format, or plain text files with a questions file), the full
cache answers each question greedily. Then each allocator at each ratio fills its own compressed cache
with the same context (question-agnostic, as in deployment) and is measured against the full cache:

* **agreement**: how often its greedy answer equals the full cache's, token for token;
* **excess NLL**: the mean negative log-likelihood (nats/token) of the full cache's answer under the
  compressed cache, minus the same under the full cache;
* **accuracy** (only with reference answers): how often the answer, the full cache's and each compressed
  cache's, contains the reference answer (:func:`.grading.is_correct`: both normalised, the answer as whole
  words).

Agreement measures sameness, not correctness: a full cache that answers wrongly makes every compressed
cache that answers rightly "disagree". With reference answers, ratios are recommended on accuracy.

What is shared, so that a check is worth waiting for: each context is prefilled once
(:class:`~lukv_cache.evaluation.prefill.SharedPrefill`); each allocator scores it once, and its other
ratios compress from the same scored prefill; and a compressed cache answers each question in one
teacher-forced forward over the full cache's answer: greedy decoding reproduces that answer exactly when,
at every token of it, the compressed cache predicts the same next token as the full cache does (and stops
where it stops), which that one forward shows, with the answer's NLL. Only ``show_answers`` decodes the
compressed answers themselves.

The recommended ratio is the highest one whose agreement stays at or above ``tolerance`` (at every lower
ratio too) for some allocator; ties go to the lower excess NLL. With reference answers (and a full cache
that answered at least one of them rightly), accuracy replaces agreement: a ratio is safe while its accuracy
stays at or above ``tolerance`` times the full cache's.

One job per module: :mod:`.inputs` (the contexts, questions and reference answers read and refused
before any model runs), :mod:`.grading` (whether an answer gives the reference), :mod:`.run` (the check
itself: every allocator at every ratio or budget against the full cache), :mod:`.report` (what it measured,
and the rows it recommends) and :mod:`.formatting` (the table, the verdicts and the recommendation, in
words).

    >>> from lukv_cache.evaluation.check.run import check
    >>> from lukv_cache.evaluation.check.formatting import format_check
    >>> report = check(model, tokenizer, [("text ...", ["question?"], ["answer"])])  # doctest: +SKIP
    >>> print(format_check(report))  # doctest: +SKIP
"""
