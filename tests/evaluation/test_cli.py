from lukv_cache.cli import build_parser
from lukv_cache.evaluation.cli import split_values


def test_lukv_has_demo_and_bench_commands():
    parser = build_parser()
    demo = parser.parse_args(["demo"])
    assert (
        demo.ratios == [0.5, 0.8] and demo.contexts == 3 and demo.model == "smollm2" and callable(demo.func)
    )
    bench = parser.parse_args(["bench", "--samples", "2", "--ratios", "0.5,0.8", "--scorers", "keydiff"])
    assert bench.samples == 2 and split_values(bench.ratios) == ["0.5", "0.8"] and callable(bench.func)


def test_bench_flags_shrink_the_grid():
    args = build_parser().parse_args(
        ["bench", "--tasks", "niah_multikey", "--allocators", "uniform", "adakv", "--context-tokens", "2000"]
    )
    assert split_values(args.tasks) == ["niah_multikey"]
    assert split_values(args.allocators) == ["uniform", "adakv"]
    assert args.context_tokens == 2000
