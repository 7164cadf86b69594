import sys

from app.bench.run import main
from app.cli.console import exit_status

sys.exit(exit_status(main))
