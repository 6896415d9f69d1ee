from coordinator.cli.app import main

raise SystemExit(main())
