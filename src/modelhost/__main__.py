from modelhost.cli import main

raise SystemExit(main())
