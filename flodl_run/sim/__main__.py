from flodl_run.sim.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
