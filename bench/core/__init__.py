"""The benchmarks' shared core; each benchmark (``bench/*.py``) measures, this package serves them all.

- ``inputs``: paths, the photos, the models ``face_pipeline`` serves (read from its repository);
- ``load``: closed-loop load (``closed_loop``) and one measured row with CPU accounting (``run_load``);
- ``processes``: CPU time and resident memory of process trees from ``/proc``; child HTTP servers;
- ``triton``: the bundled Triton through ``service.launcher``, and its statistics per model;
- ``reporting``: Markdown tables, sections of shared report files, the machine description.

A new benchmark imports from here and writes its section with ``reporting.write_section``.
"""
