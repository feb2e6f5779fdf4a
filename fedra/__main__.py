from fedra.cli import main

raise SystemExit(main())
