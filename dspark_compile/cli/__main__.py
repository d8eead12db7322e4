import sys

from dspark_compile.cli.main import main

sys.exit(main())
