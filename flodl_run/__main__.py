from flodl_run.cli import main

main()
