"""Child processes for ``processes=N`` (and ``isolate=True``, which is ``processes=1``).

Read top-down: ``processes.py`` (what the loader uses), ``run.py`` (one iteration: batches
assigned to children, handed out in order, with the in-process run's ``run/plan.py`` for the
epoch's positions, skips and budget and its ``run/handout.py`` for the user's batch),
``parent.py`` (the processes and their pipes), ``segments.py`` + ``shm.py`` (shared batch
buffers), ``merged.py`` (stats), ``protocol.py`` (the messages); the child's side is
``child.py`` (control loop), ``fill.py`` (reads, fills) and ``rows.py`` (one sample into one row).
"""
