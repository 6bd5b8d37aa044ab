"""Child processes for ``processes=N`` (and ``isolate=True``, which is ``processes=1``): the same
pipeline as in-process (``pipeline/pipeline.py``) in each child, driven by the one driver
(``epoch/driver.py``) in the user's process.

Read top-down: ``choice.py`` (what the loader uses), ``parent.py`` (the children as the
driver's pipelines; ``start.py``: where they come from; ``script.py``: whether they import the
user's script; ``lifetime.py``, ``server.py``: how none outlives this process), ``segments.py``
+ ``shm.py`` (the shared batch ring), ``merged.py`` (stats), ``protocol.py`` (what only
processes need beside ``pipeline/messages.py``); the child's side is ``child.py`` (its control loop, running the
pipeline on the shared segments).
"""
