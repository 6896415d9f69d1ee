import sys

from device_agent.cli.app import main

sys.exit(main())
