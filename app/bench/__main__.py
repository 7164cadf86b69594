from app.bench.run import main

main()
