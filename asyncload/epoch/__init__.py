"""The epoch's policy, decided on the user's thread whatever moves the samples: the driver
(``driver.py``) and its decisions as logic (``window.py``), the plan of batches (``plan.py``),
which pipeline fills which rows and the layout probe (``dispatch.py``), batches in flight, the
hand-out, and the epoch's ledger and resume (``ledger.py``). It
talks to the pipelines (``pipeline/``) through their messages and never moves a sample itself.
"""
