"""What every benchmark shares: ``inputs`` (paths, photos, the served models), ``load`` (closed-loop load),
``processes`` (CPU and memory from ``/proc``, child servers), ``triton`` (the bundled Triton and its
statistics) and ``reporting`` (Markdown tables and sections, the machine)."""
