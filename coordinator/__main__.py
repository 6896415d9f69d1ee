from coordinator.cli import main

raise SystemExit(main())
