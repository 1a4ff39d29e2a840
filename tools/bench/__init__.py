"""The bench behind `treeserve bench` (cli/bench.py): TreeServe's methods and their peers decode the same
Spec-Bench prompts with the same target in one process, side by side.

- options.py: `BenchOptions`, what one run measures;
- run.py: `run_bench`, the interleaved timed runs, the greedy check, the budget sweep, the outputs;
- runner.py: method entries (`METHOD[:BUDGET][@KIND]`), a TreeServe engine behind the runner interface,
  Spec-Bench answer lines;
- greedy.py: the target's own greedy `generate` (tokens and top-2 logit gaps), the reference of the token-for-token
  check, whose near-tie rule is engine/greedy_rule.py's (the service bench, services/bench_service.py, and the load
  test, services/loadtest.py, judge by it too);
- report.py: per-method statistics, speedups and the tables;
- peers.py: Hugging Face `generate` (plain, and on a static cache compiled with CUDA graphs), prompt lookup and
  assisted generation on the same prompts;
- projection.py: PROJECTED speedups on the 4xA100 layouts from a documented cost model, or from a measured cost
  curve;
- plots.py: the pictures.

The cost curves of `treeserve profile`, which the budget chooser reads too, are engine/hardware/.
"""
