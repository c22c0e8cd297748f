"""What runs leave behind and how it is read: the results format that training validation and ``seal.eval`` both
write (``records.py``), the tables and failure profiles of a results file (``tables.py``), a run folder's metrics and
validation results (``runs.py``) and the figures drawn from them (``figures.py``).

It sits below the step (the agent loop appends records, the trainer draws a run's figures at its end) and below
the commands that evaluate and report, so none of them imports up.
"""
