//! Parsing the command line, and a usage error as one line.

use clap::{ArgMatches, Command, CommandFactory, FromArgMatches};

use super::Cli;

/// `Cli` from the process's arguments. Every value may be a negative number (`--lr -1`
/// reaches `--lr`'s parser and is refused by it, naming the flag; clap would otherwise
/// take `-1` for an unknown flag and say nothing of `--lr`).
pub(crate) fn parse(args: &[String]) -> Result<Cli, clap::Error> {
    let mut command = negatives_as_values(Cli::command());
    let matches: ArgMatches = command.try_get_matches_from_mut(args)?;
    Cli::from_arg_matches(&matches).map_err(|e| e.format(&mut command))
}

fn negatives_as_values(command: Command) -> Command {
    command
        .mut_args(|a| {
            if a.get_num_args().is_some_and(|n| n.takes_values()) || a.get_action().takes_values() {
                a.allow_negative_numbers(true)
            } else {
                a
            }
        })
        .mut_subcommands(negatives_as_values)
}

/// clap's rendered error as one line: its first line, with what it lists under it
/// (`the following required arguments were not provided: --out <SVG>`), clap's tips (`a
/// similar argument exists: '--steps'`), the usage after an unexpected argument, and the
/// help to read (`mpiflow plot --help` when a command was named).
pub(crate) fn one_line(rendered: &str, args: &[String]) -> String {
    let names: Vec<String> = Cli::command()
        .get_subcommands()
        .map(|c| c.get_name().to_string())
        .collect();
    let command = args
        .iter()
        .skip(1)
        .take_while(|a| *a != "--")
        .find(|a| names.contains(a));
    let mut lines = rendered.lines().map(str::trim);
    let first = lines
        .next()
        .unwrap_or("bad arguments")
        .trim_start_matches("error: ");
    let listed: Vec<&str> = lines.by_ref().take_while(|l| !l.is_empty()).collect();
    let mut message = if listed.is_empty() {
        first.to_string()
    } else {
        format!("{first} {}", listed.join(", "))
    };
    for line in lines {
        if let Some(tip) = line.strip_prefix("tip: ") {
            // "use '-- X'" is right for launch's program only: elsewhere `--` ends nothing.
            if !tip.starts_with("to pass '") || command.is_some_and(|c| c == "launch") {
                message.push_str(&format!(" ({tip})"));
            }
        } else if let Some(usage) = line.strip_prefix("Usage: ") {
            if first.starts_with("unexpected argument") {
                message.push_str(&format!("; usage: {usage}"));
            }
        }
    }
    match command {
        Some(c) => format!("{message} (see mpiflow {c} --help)"),
        None => format!("{message} (see mpiflow --help)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error_of(args: &[&str]) -> String {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        match parse(&args) {
            Ok(_) => "parsed".into(),
            Err(e) => one_line(&e.render().to_string(), &args),
        }
    }

    #[test]
    fn usage_errors_are_one_line_naming_what_is_wrong() {
        let e = error_of(&["mpiflow", "plot", "run.csv"]);
        assert!(
            e.starts_with("the following required arguments were not provided: --out <SVG>"),
            "{e}"
        );
        assert!(e.ends_with("(see mpiflow plot --help)"), "{e}");
        assert!(!e.contains('\n'), "{e}");
        assert_eq!(
            error_of(&["mpiflow", "train", "--lr", "-1"]),
            "invalid value '-1' for '--lr <LR>': \"-1\" is not a positive number (see mpiflow train --help)"
        );
        let e = error_of(&["mpiflow", "train", "--steps", "-5"]);
        assert!(
            e.starts_with("invalid value '-5' for '--steps <STEPS>'"),
            "{e}"
        );
        assert_eq!(
            error_of(&["mpiflow", "train", "--stpes", "3"]),
            "unexpected argument '--stpes' found (a similar argument exists: '--steps'); \
             usage: mpiflow train --steps <STEPS> (see mpiflow train --help)"
        );
        assert_eq!(
            error_of(&["mpiflow", "launch", "python3", "trainer.py"]),
            "unexpected argument 'python3' found; usage: mpiflow launch [OPTIONS] -- \
             <PROGRAM>... (see mpiflow launch --help)"
        );
        assert_eq!(
            error_of(&["mpiflow", "nonsense"]),
            "unrecognized subcommand 'nonsense' (see mpiflow --help)"
        );
        // Flags still parse; a program's own negative numbers go through `launch --`.
        assert_eq!(error_of(&["mpiflow", "train", "--lr", "0.1"]), "parsed");
        assert_eq!(
            error_of(&["mpiflow", "launch", "--", "prog", "-1", "--lr", "-2"]),
            "parsed"
        );
    }
}
