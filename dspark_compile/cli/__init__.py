"""The `dspark-compile` command line (`python -m dspark_compile.cli` runs it too).

    main.py             the parser built from the command table; exit statuses; SIGTERM
    common.py           the command table (`command`), flag parsing helpers, the user errors
    engine_commands.py  synth, build, generate, run, inspect (serve: dspark_compile/serve/cli.py)
"""
