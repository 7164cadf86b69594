"""The training command's machinery under ``cli.py``: the LightningCLI subclass and ``build``
(``lightning_cli.py``), one-line user errors (``errors.py``, ``console.py``) and the run
folder's loggers (``run_folder.py``)."""
