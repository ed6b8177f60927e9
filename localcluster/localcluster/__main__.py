from localcluster.cli import main

raise SystemExit(main())
