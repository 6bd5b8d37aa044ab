"""What the benchmark's entry points share: data, workloads, contenders, the runner and its worker
processes, measurement of the process tree, the machine, the report. The entry points are the
modules of ``bench/`` itself (``python -m bench``, ``python -m bench.memory``, ...)."""
