"""What an operator watches a run with; none of it changes the ledger but by its CLI verbs.

    status.py    the per-dataset table of ``datagen status``
    dead.py      samples given up on, grouped by reason (``datagen dead``)
    metrics.py   the Prometheus endpoint (``datagen metrics``)
    flower.py    Flower's command line and its login
    plot.py      committed tokens per dataset against the budgets (``datagen plot``)
    progress.py  the live progress line of ``datagen run`` and ``datagen extract``
"""
