"""`python -m flodl_run`: fork the spare rank zygote first, while this process is one bare
thread (flodl_run/launch/zygote.py says why), then run the CLI."""

from flodl_run.launch.zygote import prefork

if __name__ == "__main__":
    prefork()
    from flodl_run.cli import main

    main()
