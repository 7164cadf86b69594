import sys

from app.bench.run import exit_code, main
from app.cli.console import exit_status

sys.exit(exit_status(lambda: exit_code(main())))
