"""One epoch: the driver deciding every policy on the user's thread (``driver.py``) and the
pipeline moving samples (``pipeline.py``), in this process or in child processes (``procs/``)."""
