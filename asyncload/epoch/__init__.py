"""The epoch's policy, decided on the user's thread whatever moves the samples: the driver
(``driver.py``), the plan of batches (``plan.py``), the layout probe, which pipeline fills which
rows (``dispatch.py``), batches in flight, the hand-out and the epoch's progress and resume. It
talks to the pipelines (``pipeline/``) through their messages and never moves a sample itself.
"""
