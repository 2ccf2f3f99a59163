from modelhost.cli.main import main

raise SystemExit(main())
