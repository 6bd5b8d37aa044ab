"""What moves samples, deciding nothing: the pipeline (``pipeline.py``) reads and decodes into
batch rows on its event loop and decode threads (``jobs.py``, ``batched.py``, ``workers.py``,
``threads.py``, ``slots.py``), answering the driver's messages (``messages.py``). The same code
runs in this process (``pipes.py``'s ``LocalPipes``) and in each child of ``processes=N``.
"""
