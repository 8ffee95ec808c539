from coordinator.cli.main import main

main()
