"""The benchmarks: scripts that print a table, run as modules from the repository root
(``python -m benchmarks.bench_isolation --help``); raw results in ``benchmarks/results/``.

* ``bench_isolation`` - one GDN / Mamba2 layer step under SAC in every mode (one device);
* ``bench_cp`` - one CP=2 GDN layer step over NCCL (a CPU smoke test on gloo); its rows: ``cp_rows``;
* ``bench_ep_step`` - the whole EP=2 tiny-model step of the regression (two GPUs);
* ``bench_pp_one_gpu`` - the tiny decoder's PP stages on one device in one process, torch's schedules;
* ``saved_outputs`` - the MiB ``policies.save_fla_ops`` keeps per layer, from the operators' fake kernels;
* ``layer_step`` - what the layer benchmarks share: the mode's layer and offsets, timed/probed/memory steps,
  the interleaved measuring loop; ``charts`` - their bar chart; ``recompute_profile`` - per-kernel times of
  one recompute (``bench_isolation --profile``); ``outcome`` - every script's exit code (did anything run, what
  is missing).

They import the library (``fla_ac_isolation``) and each other as this package, nothing by path.
"""
