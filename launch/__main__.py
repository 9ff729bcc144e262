import sys

from fedbus.launch.cli import main

sys.exit(main())
