"""What moves samples, deciding nothing: the pipeline (``pipeline.py``) reads and decodes into
batch rows on its event loop and decode threads (``jobs.py``, ``batched.py``, ``workers.py``,
``threads.py``, ``watchdog.py``), answering the driver's messages (``messages.py``). The same code
runs in this process (``pipelines.py``'s ``LocalPipeline``) and in each child of ``processes=N``.
"""
