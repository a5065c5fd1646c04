"""`python -m lowtide` is the `lowtide` command."""

from lowtide.cli.main import app

app(prog_name="lowtide")
