from omlx_cli.main import run

run()
