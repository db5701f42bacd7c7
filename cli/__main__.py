from kvpool.cli.app import main

main()
