from h3serve.cli.main import main

main()
